"""Capacity maths (DESIGN.md §4): filled in by the engine issue."""
