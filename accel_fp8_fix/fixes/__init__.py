"""The wrapper code of each fix, in rooms by the moment of a run (start/, convert/, all_gather/, checkpoint/, step/)
under the prepare spine (prepare.py, trainer.py); which fixes apply to which versions is declared in ``patches/``."""
