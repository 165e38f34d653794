"""Experiment grids: the cells of a grid file, their launchers, and the report over seeds beside the papers'.

:mod:`.spec` reads a grid file into its cells; :mod:`.folder` is the grid's folder and each cell's state;
:mod:`.local` runs the cells on this machine, :mod:`.slurm` as a SLURM job array through submitit; :mod:`.report`
writes the tables and figures. ``polyattn grid`` (``commands/grid.py``) drives them.
"""

from .folder import CellState, Job, cell_state
from .spec import Cell, GridSpec, cells, read_grid

__all__ = ["Cell", "CellState", "GridSpec", "Job", "cell_state", "cells", "read_grid"]
