"""The one exception type users see for a broken checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint folder or file cannot be used; the message names the file and the tensor."""
