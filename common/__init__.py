"""Small pieces every package shares: the strict config base and recipe-file loading. Imports no torch."""
