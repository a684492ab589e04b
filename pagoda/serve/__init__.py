"""Layer package: see DESIGN.md."""
