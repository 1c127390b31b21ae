"""The DiPaCo math of one run: model, grid, steps, recipe; no files, no runtime."""
