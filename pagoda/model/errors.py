"""The one error type model loading raises: a message a user can act on, naming the file."""


class ModelLoadError(Exception):
    """Raised for any problem loading a model (bad path, architecture, tensor, GGUF type)."""
