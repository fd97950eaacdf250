"""Knowledge-check quizzes for the end of each notebook.

``quiz([...])`` shows one radio-button question per item with a "check" button and an explanation. In a
headless run (papermill, nbval) nothing is clicked; ``answers_text`` renders the same quiz as plain text
so a printed notebook still carries it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as widgets


@dataclass(frozen=True)
class Question:
    question: str
    options: tuple[str, ...]
    answer: int
    why: str

    def __post_init__(self) -> None:
        if not 0 <= self.answer < len(self.options):
            raise ValueError(f"answer index {self.answer} out of range for {len(self.options)} options")


def _as_question(item: Question | dict) -> Question:
    if isinstance(item, Question):
        return item
    return Question(item["question"], tuple(item["options"]), int(item["answer"]), item.get("why", ""))


def _question_widget(q: Question, number: int) -> widgets.VBox:
    choice = widgets.RadioButtons(options=list(q.options), value=None, layout={"width": "max-content"})
    feedback = widgets.HTML()
    button = widgets.Button(description="check")

    def on_click(_: object) -> None:
        if choice.value is None:
            feedback.value = "<i>pick an answer first</i>"
        elif q.options.index(choice.value) == q.answer:
            feedback.value = f"<b style='color:green'>Right.</b> {q.why}"
        else:
            feedback.value = f"<b style='color:#b00'>Not quite.</b> {q.why}"

    button.on_click(on_click)
    return widgets.VBox([widgets.HTML(f"<b>{number}. {q.question}</b>"), choice, button, feedback])


def quiz(items: list[Question | dict]) -> widgets.VBox:
    """An interactive quiz: items are ``Question``s or dicts with question/options/answer/why."""
    questions = [_as_question(item) for item in items]
    return widgets.VBox([_question_widget(q, i + 1) for i, q in enumerate(questions)])


def answers_text(items: list[Question | dict]) -> str:
    """The quiz with its answers as plain text (for headless runs and printed notes)."""
    lines = []
    for i, q in enumerate(_as_question(item) for item in items):
        lines.append(f"{i + 1}. {q.question}")
        lines += [f"   {'*' if j == q.answer else ' '} {opt}" for j, opt in enumerate(q.options)]
        lines.append(f"   why: {q.why}")
    return "\n".join(lines)
