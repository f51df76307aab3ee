"""Errors shared by the CLI, the engine and the server."""


class InputError(ValueError):
    """Bad input from a user: the CLI exits 2 with one line, the server answers 400.

    `field` names the offending request field or flag where there is one.
    """

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        if len(message) > 600:  # never echo a huge bad value back (or into the log) whole
            message = f"{message[:500]}...({len(message)} characters)"
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status

    def to_json(self) -> dict:
        return {"error": self.message, "field": self.field}
