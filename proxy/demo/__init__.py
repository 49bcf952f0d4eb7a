"""`loopwarden demo`: a scripted model and example tools, for the demo only."""
