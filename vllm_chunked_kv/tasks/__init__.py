"""Synthetic tasks shared by the demo model, its training, the scanner and the tests."""
