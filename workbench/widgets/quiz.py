"""Knowledge checks that test: hidden answer keys, options shuffled per learner, numeric tolerances, a score.

A notebook builds one ``QuizBook``, shows its questions, and ends with a score cell::

    QUIZ = QuizBook("02 collective algorithms", seed=LEARNER_SEED)
    QUIZ.show(
        Choice("nb02.tree", "When does a binomial tree all-reduce beat a ring?", {
            "for large tensors on few ranks": "what a learner who picks this reads, after answering",
            "for small tensors on many ranks": "...",
        }, key="5c0d..."),
        Numeric("nb02.ring-bytes", "How many MB does each rank send ...?", unit="MB", rel_tol=0.02,
                key="num:...", why="how to get there, shown after answering"),
    )
    ...
    QUIZ.answer_all(QUIZ_ANSWERS)  # headless: papermill -p QUIZ_ANSWERS '{"nb02.ring-bytes": 1750}'
    QUIZ.scoreboard()              # "k of n correct", and which are unanswered

Answer keys: the notebook never holds an answer. A choice's ``key`` is ``answer_key(id, correct_option)``, the
first 20 hex digits of sha256("<salt>:<id>:<option>"); a numeric ``key`` is the value sealed with a pad derived
from the id (``answer_key(id, 1750.0)``). Authors compute a key once and paste it. This hides answers from
reading, not from a learner determined to try every option through ``answer``; the answers themselves are kept
with the tests. Feedback is required for every option (so a missing one does not give the key away) and
explains without a verdict: "Right" / "Not quite" comes from the key, so no option's feedback (and no numeric
``why``) may begin with one ("Right:", "Correct.", "No,", "Yes", "Not quite", ...); building such a question raises
``QuizError``. A numeric ``why`` shows the way to the answer, not the answer: it is read after a wrong try too.

Options are shuffled per learner: ``seed`` (a number or a learner id; by default ``$WORKBENCH_LEARNER`` or the
login name) fixes the order, so the same seed always gives the same quiz and papermill runs are reproducible.
Rendering never waits for input: in a headless run the widgets render as plain text and ``answer`` grades.
"""

from __future__ import annotations

import base64
import getpass
import hashlib
import html
import os
import random
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import ipywidgets as widgets

_SALT = "workbench-quiz-v1"
_NUMERIC = "num:"
_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class QuizError(ValueError):
    """A quiz definition or an answer that cannot be graded; the message names the question."""


def answer_key(question_id: str, answer: str | float) -> str:
    """The ``key`` to paste into a question: a salted hash of an option (str) or a sealed number."""
    if isinstance(answer, str):
        return _choice_hash(question_id, answer)
    return _seal(question_id, float(answer))


def _choice_hash(question_id: str, option: str) -> str:
    return hashlib.sha256(f"{_SALT}:{question_id}:{option.strip()}".encode()).hexdigest()[:20]


def _pad(question_id: str, raw: bytes | None = None) -> bytes:
    tail = b"value" if raw is None else b"check" + raw
    return hashlib.sha256(f"{_SALT}:{question_id}:".encode() + tail).digest()


def _seal(question_id: str, value: float) -> str:
    raw = struct.pack(">d", value)
    body = bytes(a ^ b for a, b in zip(raw, _pad(question_id)[:8], strict=True))
    return _NUMERIC + base64.urlsafe_b64encode(body + _pad(question_id, raw)[:4]).decode()


def _unseal(question_id: str, key: str) -> float:
    try:
        blob = base64.urlsafe_b64decode(key.removeprefix(_NUMERIC)) if key.startswith(_NUMERIC) else b""
    except ValueError:
        blob = b""
    raw = bytes(a ^ b for a, b in zip(blob[:8], _pad(question_id)[:len(blob[:8])], strict=True))
    if len(blob) != 12 or _pad(question_id, raw)[:4] != blob[8:]:
        raise QuizError(f"question {question_id!r}: key {key!r} is not a numeric key made for this id; "
                        f"recompute it with answer_key({question_id!r}, <the value>)")
    return struct.unpack(">d", raw)[0]


# A verdict word or phrase at the start of a feedback text: "Right: ...", "No, ...", "Yes ...", "That's correct".
# "No rank ever gathers ..." or "Correct gradients need ..." are sentences, not verdicts: the words that also
# start ordinary sentences count only when punctuation follows them.
_VERDICT = re.compile(
    r"^\W*(?:(?:right|correct|wrong|incorrect|true|false|exactly|indeed|precisely|close|almost|no|nope|yes|yep|"
    r"good|great|nice|well done|spot on|not quite|not really|partly|partially)\s*[:,.;!?—–-]"
    r"|(?:yes|yep|yeah|nope|not quite|well done|spot on)\b"
    r"|(?:that'?s|that is|this is|you'?re|you are) (?:right|correct|wrong|incorrect|it)\b)",
    re.IGNORECASE)


def verdict(feedback: str) -> str | None:
    """The verdict a feedback text begins with ("Right:", "No,", ...), or None: feedback explains, the key judges.

    >>> verdict("Right: each backward starts early"), verdict("No rank ever gathers all keys")
    ('Right:', None)
    """
    match = _VERDICT.match(feedback)
    return match.group(0).strip() if match else None


def _check_feedback(question_id: str, what: str, feedback: str) -> None:
    found = verdict(feedback)
    if found:
        raise QuizError(f"question {question_id!r}: the feedback for {what} begins with a verdict ({found!r}); the "
                        f"grade already says right or not quite, so explain the reasoning instead")


def _check_id(question_id: str) -> None:
    if not _ID.match(question_id):
        raise QuizError(f"question id {question_id!r}: use letters, digits, '.', '-' or '_' (e.g. 'nb02.ring-bytes')")


@dataclass(frozen=True)
class Result:
    """The grade of one answer: ``feedback`` is what the learner reads after answering."""

    question_id: str
    value: str | float
    correct: bool
    feedback: str

    def __str__(self) -> str:
        return f"{self.question_id}: {'right' if self.correct else 'not quite'}. {self.feedback}"


@dataclass(frozen=True)
class Choice:
    """One multiple-choice question: ``options`` maps each option to the feedback a learner who picks it reads."""

    id: str
    question: str
    options: Mapping[str, str]
    key: str

    def __post_init__(self) -> None:
        _check_id(self.id)
        if len(self.options) < 2:
            raise QuizError(f"question {self.id!r}: a choice needs at least two options")
        bare = [o for o, why in self.options.items() if not o.strip() or not why.strip()]
        if bare:
            raise QuizError(f"question {self.id!r}: every option needs text and feedback; missing for {bare}")
        for option, why in self.options.items():
            _check_feedback(self.id, f"option {option!r}", why)
        matches = sum(_choice_hash(self.id, o) == self.key for o in self.options)
        if matches != 1:
            how = "none" if matches == 0 else f"{matches} (options equal but for spaces)"
            raise QuizError(f"question {self.id!r}: key {self.key!r} matches {how} of its {len(self.options)} "
                            f"options; recompute it with answer_key({self.id!r}, <the correct option>)")

    @property
    def prompt(self) -> str:
        return self.question

    def check(self, value: str | float) -> Result:
        option = str(value).strip()
        if option not in self.options:
            raise QuizError(f"question {self.id!r}: {option!r} is not one of its options {list(self.options)}")
        right = _choice_hash(self.id, option) == self.key
        return Result(self.id, option, right, self.options[option])


@dataclass(frozen=True)
class Numeric:
    """A question answered by a number, right within ``rel_tol`` (a fraction) or ``abs_tol`` (in ``unit``)."""

    id: str
    question: str
    key: str
    unit: str = ""
    rel_tol: float | None = None
    abs_tol: float | None = None
    why: str = ""

    def __post_init__(self) -> None:
        _check_id(self.id)
        tolerances = [t for t in (self.rel_tol, self.abs_tol) if t is not None]
        if len(tolerances) != 1 or tolerances[0] < 0:
            raise QuizError(f"question {self.id!r}: give exactly one tolerance, rel_tol or abs_tol, ≥ 0")
        if not self.why.strip():
            raise QuizError(f"question {self.id!r}: a numeric question needs `why`, the way to the answer")
        _check_feedback(self.id, "`why`", self.why)
        _unseal(self.id, self.key)

    @property
    def tolerance(self) -> str:
        if self.rel_tol is not None:
            return f"answers within ±{self.rel_tol:.0%} count"
        return "exact answers only" if self.abs_tol == 0 else f"answers within ±{self.abs_tol:g} {self.unit} count"

    @property
    def prompt(self) -> str:
        unit = f"in {self.unit}; " if self.unit else ""
        return f"{self.question} ({unit}{self.tolerance})"

    def check(self, value: str | float) -> Result:
        number = _as_number(self.id, value)
        expected = _unseal(self.id, self.key)
        slack = self.abs_tol if self.abs_tol is not None else abs(expected) * (self.rel_tol or 0.0)
        if abs(number - expected) <= slack:
            unit = f" {self.unit}" if self.unit else ""
            return Result(self.id, number, True, f"Expected {expected:.4g}{unit}. {self.why}")
        return Result(self.id, number, False, f"{_miss(number, expected)} {self.why}")


def _as_number(question_id: str, value: str | float) -> float:
    if isinstance(value, bool):
        raise QuizError(f"question {question_id!r}: answer with a number, not {value!r}")
    try:
        return float(str(value).replace(",", "").replace("_", "").strip())
    except ValueError:
        raise QuizError(f"question {question_id!r}: answer with a number, not {value!r}") from None


_FACTORS = {8.0: "bits vs bytes?", 2**30 / 1e9: "GiB (2³⁰ bytes) vs GB (10⁹)?", 1e3: "a unit prefix (k, M, G)?",
            2.0: "a dtype width (2 vs 4 bytes), or one tensor counted twice or left out?",
            4.0: "a dtype width (1, 2 or 4 bytes), or a count of tensors?"}


def _miss(number: float, expected: float) -> str:
    """Which way the answer is off, and the usual slip when it is off by a telling factor."""
    direction = "Too high." if number > expected else "Too low."
    if number == 0 or expected == 0:
        return direction
    ratio = max(abs(number / expected), abs(expected / number))
    for factor, slip in _FACTORS.items():
        if abs(ratio / factor - 1) < 0.005:
            return f"{direction} Off by a factor of {factor:.3g}: {slip}"
    return direction


Question = Choice | Numeric


@dataclass(frozen=True)
class Score:
    """``correct`` of ``total`` right (the latest answer counts), ``first_try`` right at once, and the unanswered."""

    correct: int
    total: int
    first_try: int
    unanswered: tuple[str, ...]

    def __str__(self) -> str:
        rest = f"; unanswered: {', '.join(self.unanswered)}" if self.unanswered else ""
        return f"{self.correct} of {self.total} correct ({self.first_try} at the first try){rest}"


def _learner_seed(seed: int | str | None) -> int | str:
    if seed is not None:
        return seed
    try:
        return os.environ.get("WORKBENCH_LEARNER") or getpass.getuser()
    except OSError:  # no login name in some containers
        return "learner"


@dataclass
class QuizBook:
    """A notebook's questions, its learner's answers and the score."""

    name: str
    seed: int | str | None = None
    questions: dict[str, Question] = field(default_factory=dict)
    results: dict[str, Result] = field(default_factory=dict)
    first_results: dict[str, bool] = field(default_factory=dict)
    _listeners: list[Callable[[Result], None]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.seed = _learner_seed(self.seed)

    def add(self, *questions: Question) -> QuizBook:
        """Add questions. An id used twice is an error; re-adding an identical question (a re-run cell) is not."""
        ids = [q.id for q in questions]
        twice = sorted({q.id for q in questions if ids.count(q.id) > 1 or self.questions.get(q.id, q) != q})
        if twice:
            raise QuizError(f"quiz {self.name!r}: question id(s) {twice} used twice; each question needs its own id")
        self.questions.update((q.id, q) for q in questions)
        return self

    def question(self, question_id: str) -> Question:
        if question_id not in self.questions:
            raise QuizError(f"quiz {self.name!r} has no question {question_id!r}; it has {list(self.questions)}")
        return self.questions[question_id]

    def options(self, question_id: str) -> list[str]:
        """A choice's options in this learner's order (the same seed always gives the same order)."""
        q = self.question(question_id)
        order = list(q.options) if isinstance(q, Choice) else []
        random.Random(f"{self.seed}:{question_id}").shuffle(order)
        return order

    def answer(self, question_id: str, value: str | float) -> Result:
        """Grade an answer (an option's text, or a number), record it and return the feedback."""
        result = self.question(question_id).check(value)
        self.first_results.setdefault(question_id, result.correct)
        self.results[question_id] = result
        for listener in self._listeners:
            listener(result)
        return result

    def answer_all(self, answers: Mapping[str, str | float]) -> list[Result]:
        return [self.answer(qid, value) for qid, value in answers.items()]

    def score(self) -> Score:
        return Score(correct=sum(r.correct for r in self.results.values()), total=len(self.questions),
                     first_try=sum(self.first_results.values()),
                     unanswered=tuple(q for q in self.questions if q not in self.results))

    def text(self, ids: Iterable[str] | None = None) -> str:
        """The questions as plain text, options in this learner's order, no answers."""
        ids = list(self.questions if ids is None else ids)
        lines = [f"Knowledge check: {self.name} (option order of learner seed {self.seed!r})"]
        for number, qid in enumerate(ids, 1):
            lines.append(f"{number}. [{qid}] {self.question(qid).prompt}")
            lines += [f"   {chr(97 + i)}) {option}" for i, option in enumerate(self.options(qid))]
        lines.append('Answer with the widgets, or in code: <quiz>.answer("<id>", "<option text>" or <number>)')
        return "\n".join(lines)

    def score_text(self) -> str:
        lines = [f"Score, {self.name}: {self.score()}"]
        lines += [f"  {'✓' if r.correct else '✗'} {qid}: {r.feedback}" for qid, r in self.results.items()]
        return "\n".join(lines)

    def widget(self, ids: Iterable[str] | None = None) -> widgets.VBox:
        """One interactive box per question (radio buttons or a number field, a check button, feedback)."""
        ids = list(self.questions if ids is None else ids)
        return widgets.VBox([self._question_widget(qid, n) for n, qid in enumerate(ids, 1)])

    def show(self, *questions: Question) -> None:
        """Add ``questions`` and display them (widgets in Jupyter, plain text in a headless run); never blocks."""
        self.add(*questions)
        ids = [q.id for q in questions] or None
        _display(self.widget(ids), self.text(ids))

    def scoreboard(self) -> None:
        """Display the score; in Jupyter it updates as the learner answers."""
        board = widgets.HTML(self._score_html())
        self._listeners.append(lambda _: setattr(board, "value", self._score_html()))
        _display(board, self.score_text())

    def _score_html(self) -> str:
        return f"<b>Score:</b> {html.escape(str(self.score()))}"

    def _question_widget(self, question_id: str, number: int) -> widgets.VBox:
        q = self.question(question_id)
        control = _control(q, self.options(question_id))
        feedback, button = widgets.HTML(), widgets.Button(description="check")
        self._listeners.append(lambda r: _show_result(feedback, r) if r.question_id == question_id else None)
        button.on_click(lambda _: self._check_control(question_id, control.value, feedback))
        header = widgets.HTML(f"<b>{number}. {html.escape(q.prompt)}</b>")
        return widgets.VBox([header, control, button, feedback])

    def _check_control(self, question_id: str, value: str | None, feedback: widgets.HTML) -> None:
        if value is None or not str(value).strip():
            feedback.value = "<i>answer first</i>"
            return
        try:
            self.answer(question_id, value)
        except QuizError as err:
            feedback.value = f"<i>{html.escape(str(err))}</i>"


def _control(q: Question, options: list[str]) -> widgets.RadioButtons | widgets.Text:
    if isinstance(q, Choice):
        return widgets.RadioButtons(options=options, value=None, layout={"width": "max-content"})
    return widgets.Text(placeholder=f"a number, in {q.unit}" if q.unit else "a number")


def _show_result(feedback: widgets.HTML, result: Result) -> None:
    verdict = "<b style='color:green'>Right.</b>" if result.correct else "<b style='color:#b00'>Not quite.</b>"
    feedback.value = f"{verdict} {html.escape(result.feedback)}"


def _display(widget: widgets.Widget, text: str) -> None:
    """The widget where a front end can draw it, ``text`` as its plain-text form (papermill, nbval, a terminal)."""
    from IPython import get_ipython
    from IPython.display import display

    if get_ipython() is None:
        print(text)
        return
    bundle = dict(widget._repr_mimebundle_() or {})
    bundle["text/plain"] = text
    display(bundle, raw=True)
