"""The wrapper code of each fix; which ones apply to which versions is declared in ``patches/``."""
