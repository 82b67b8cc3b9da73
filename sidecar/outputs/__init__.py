"""Where the daemon's decisions go: publishers (files, nginx, ADS) and services (per-request
answers), each behind an interface."""
