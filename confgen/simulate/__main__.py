"""`python -m confgen.simulate`: the same as `confgen simulate`."""

from . import main

raise SystemExit(main())
