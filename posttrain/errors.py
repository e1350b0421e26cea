"""User-facing errors: each message names what is wrong and where (file, row, field)."""


class UserError(Exception):
    """Bad input a user can fix. The CLI prints it without a traceback and exits with status 2."""


class DataError(UserError):
    """A dataset row is malformed. `str(e)` reads `file:row: field: problem`."""

    def __init__(self, source: str, row: int | None, field: str | None, problem: str):
        self.source, self.row, self.field, self.problem = source, row, field, problem
        where = source if row is None else f"{source}:{row}"
        super().__init__(f"{where}: {field}: {problem}" if field else f"{where}: {problem}")
