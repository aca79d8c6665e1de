"""Recovery: the sweeper, resolution of unknown outcomes, and the broker queue peek (DESIGN.md section 5)."""
