"""Experiment grids: the cells of a grid file, their launchers, and the report over seeds beside the papers'."""
