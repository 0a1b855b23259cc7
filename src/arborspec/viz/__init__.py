"""Pictures: matplotlib set up once (canvas.py) and drawings of drafted trees (trees.py)."""
