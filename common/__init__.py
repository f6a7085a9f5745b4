"""Small pieces every package shares: the strict config base, recipe-file loading, a CPU clock, free ports. Imports no
torch."""
