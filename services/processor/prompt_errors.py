"""Why a prompt is refused: what the tokenizer, the chat rendering and the request checks raise."""

from __future__ import annotations


class PromptError(ValueError):
    """The prompt cannot be turned into tokens (bad template input, ids out of the vocabulary);
    `param` names the request field at fault, when one is."""

    def __init__(self, message: str, param: str = "") -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(PromptError):
    """The prompt, or the prompt plus the tokens asked for, cannot fit the model's context."""
