"""The one exception type for mistakes a user can fix.

The CLI turns a UserError into a single line on stderr and a non-zero exit; anything
else is a bug in mlmlab and keeps its traceback.
"""


class UserError(Exception):
    """Bad input or configuration: the message says what is wrong and what to do."""
