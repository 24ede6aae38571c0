"""The error a bad request field raises, below every module that raises it: sampling
parameters, structured-output specs, tool choices and the engine's own checks all name the
field they refuse, so that a server can point the client at it."""


class InvalidParameter(ValueError):
    """A bad sampling value. ``param`` names the field, so a server can point at it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
