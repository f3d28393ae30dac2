class PatchError(RuntimeError):
    """A patch set could not be applied; nothing of it stays applied."""
