"""Raises from a function the script calls: the user's traceback has two frames, both here."""


def inner():
    raise ValueError("raised by the user's code")


inner()
