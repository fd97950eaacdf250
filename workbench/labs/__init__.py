class LabCheckFailed(AssertionError):
    """A lab answer is wrong; the message is a hint pointing at the mistake."""
