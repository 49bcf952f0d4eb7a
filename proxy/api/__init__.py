"""The HTTP app: parse, run, render."""
