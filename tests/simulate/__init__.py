"""Tests of the simulated inference fleet (confgen.simulate)."""
