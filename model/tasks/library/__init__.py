"""toolkit: small utilities for text, numbers, sequences, dates, money and grids."""
