"""The one exception type for bad input.

Anything the user can fix by changing a flag, an argument or a file raises a
subclass of :class:`UsageError` with one sentence naming the value and what
would be accepted. The CLI turns it into that sentence and exit status 2,
never a traceback; everything else is a bug and keeps its traceback.
"""


class UsageError(ValueError):
    """Bad input: the message is one sentence a user can act on."""


def choice_error(what: str, value: object, accepted: "list[str] | tuple[str, ...]") -> UsageError:
    """The standard sentence for a value outside a fixed set of names."""
    return UsageError(f"unknown {what} {value!r}; choose one of {', '.join(accepted)}")


class TrainingError(RuntimeError):
    """The run cannot go on (a non-finite loss): one sentence, exit status 1, no traceback."""
