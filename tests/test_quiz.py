"""Quizzes that test: hidden keys, per-learner shuffles, numeric tolerances, scores, clear errors; and every
notebook's and lab's quiz is graded against the answers kept here (never in the notebooks)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import ipywidgets as widgets
import nbformat
import pytest

from workbench.widgets.quiz import Choice, Numeric, QuizBook, QuizError, Result, answer_key, verdict

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LABS = sorted((ROOT / "labs").glob("*.ipynb"))

# The answer key of every notebook's and lab's quiz: a number, or the start of the correct option's text.
ANSWERS: dict[str, str | float] = {
    "nb00.allreduce-value": 36, "nb00.own-chunk": "reduce-scatter", "nb00.timeout": "so a collective that one rank",
    "nb00.collective-vs-p2p": "every rank of the group must call it",
    "nb01.activations-linear": "each token of each sequence", "nb01.adam-bytes": 56,
    "nb01.bf16-16bytes": "the update runs on fp32 master", "nb01.bf16-vs-fp16": "bf16 has fp32's exponent range",
    "nb01.zero-grad": "parameters and optimizer state", "nb01.selective": "the attention kernel is fused",
    "nb02.ring-bytes": 1750, "nb02.ring-n-independent": "each rank sends 2(N−1) chunks",
    "nb02.tree": "small tensors on many ranks", "nb02.hierarchical": "only S/8 per GPU", "nb02.rs-owner": "chunk r",
    "nb03.identical": "they start equal", "nb03.allreduce-time": 0.975,
    "nb03.reverse-buckets": "backward makes the last",
    "nb03.tiny-buckets": "many more all-reduces", "nb03.no-sync": "1", "nb03.scaling-eff": 80,
    "nb03.more-gpus": "exposed communication", "nb03.dp-vs-tp": "DP splits the batch",
    "nb04.stage-1": "the optimizer state", "nb04.zero3-bytes": 17.5, "nb04.zero1-bytes": 293.125,
    "nb04.stages-tradeoff": "1: optimizer state, 2Ψ; 2: + gradients, 2Ψ", "nb04.zero2-comm": "its reduce-scatter plus",
    "nb04.offload": "device memory for PCIe", "nb04.several-strategies": "ZeRO shards memory, not work",
    "nb04.checkpoint": "Adam's moments restart from zero",
    "lab02.bytes": 6, "lab02.owner": "chunk (r + 1) mod N", "lab02.deadlock": "if every rank blocks in send",
    "lab03.order": "collectives are matched by call order", "lab03.buckets": 16,
    "lab03.average": "so the update equals", "lab04.partition": "ranks that disagree", "lab04.state-bytes": 1.0,
    "lab04.stage2": "each rank keeps only its gradient",
}

# Later notebooks and labs keep their keys beside this file, one JSON object per notebook or lab
# (tests/quiz_answers/nb07.json ...), so several can be written at once without touching this dict.
for _extra in sorted((ROOT / "tests" / "quiz_answers").glob("*.json")):
    ANSWERS.update(json.loads(_extra.read_text()))

# CURRICULUM.md's knowledge checks, and the question that asks each.
CURRICULUM_CHECKS = {
    "why large models need several parallelism strategies": "nb04.several-strategies",
    "why checkpoints are part of training quality": "nb10.training-quality",
    "DP vs TP": "nb03.dp-vs-tp",
    "the three ZeRO stages and their trade-offs": "nb04.stages-tradeoff",
    "why more GPUs is not always faster": "nb03.more-gpus",
    "why bf16 is preferred over fp16 for LLMs": "nb01.bf16-vs-fp16",
}


def _choice(qid: str = "t.c", correct: str = "reduce-scatter") -> Choice:
    options = {"all-gather": "concatenates, sums nothing", "reduce-scatter": "sums, keeps one chunk per rank",
               "broadcast": "copies rank 0's tensor", "all-reduce": "the whole sum everywhere",
               "gather": "everything to one rank", "scatter": "rank 0's chunks to each rank"}
    return Choice(qid, "Which collective leaves each rank one chunk of the sum?", options, key=answer_key(qid, correct))


def _numeric(qid: str = "t.n", value: float = 112.0, **tol: float) -> Numeric:
    return Numeric(qid, "Model state of a 7B fp32 AdamW model?", key=answer_key(qid, value), unit="GB",
                   why="count bytes per parameter", **(tol or {"rel_tol": 0.05}))


def _strings(w: widgets.Widget) -> list[str]:
    """Every string a widget tree would send to the front end."""
    state = w.get_state()
    # References to other widget models ("IPY_MODEL_<random hex>") are ids, not text: leaving them out keeps a
    # random id that happens to contain "112" from failing the leak check below (it did, now and then).
    out = [v for k, v in state.items() if isinstance(v, str) and k not in ("_model_module", "_view_module")
           and not v.startswith("IPY_MODEL_")]
    out += [str(o) for o in getattr(w, "options", ())]
    return out + [s for child in getattr(w, "children", ()) for s in _strings(child)]


def test_keys_are_hidden_in_text_and_widgets_until_answered():
    c, n = _choice(), _numeric()
    book = QuizBook("t", seed=0).add(c, n)
    rendered = [book.text(), *_strings(book.widget())]
    for secret in [c.key, n.key, "112", *c.options.values(), n.why]:
        assert not any(secret in s for s in rendered), secret
    assert "±5%" in book.text() and "in GB" in book.text()  # the tolerance is stated with the question
    shown = book.widget()
    wrong = book.answer("t.c", "all-gather")
    assert not wrong.correct and wrong.feedback == c.options["all-gather"]
    after = _strings(shown)
    assert any(c.options["all-gather"] in s for s in after) and not any(c.options["reduce-scatter"] in s for s in after)


def test_choice_key_is_a_salted_hash_not_an_index():
    c = _choice()
    assert re.fullmatch(r"[0-9a-f]{20}", c.key) and "reduce-scatter" not in c.key
    assert answer_key("other.id", "reduce-scatter") != c.key  # salted with the question id
    assert answer_key("t.n", 112.0).startswith("num:") and "112" not in answer_key("t.n", 112.0)


def test_shuffle_is_deterministic_per_seed_and_differs_across_seeds():
    order = {seed: QuizBook("t", seed=seed).add(_choice()).options("t.c") for seed in range(8)}
    assert all(sorted(o) == sorted(_choice().options) for o in order.values())
    assert QuizBook("t", seed=3).add(_choice()).options("t.c") == order[3]
    ada = [QuizBook("t", seed="ada").add(_choice()).options("t.c") for _ in range(2)]
    assert ada[0] == ada[1]
    assert len({tuple(o) for o in order.values()}) > 4
    assert QuizBook("t", seed=0).widget().children == ()


def test_seed_defaults_to_the_learner(monkeypatch):
    monkeypatch.setenv("WORKBENCH_LEARNER", "grace")
    assert QuizBook("t").seed == "grace"


@pytest.mark.parametrize(("tol", "value", "right"), [
    ({"rel_tol": 0.05}, 112, True), ({"rel_tol": 0.05}, 117.5, True), ({"rel_tol": 0.05}, 106.5, True),
    ({"rel_tol": 0.05}, 118, False), ({"rel_tol": 0.05}, 106, False), ({"rel_tol": 0.05}, "1.12e2", True),
    ({"abs_tol": 2.0}, 113.9, True), ({"abs_tol": 2.0}, 114.1, False), ({"abs_tol": 0}, 112, True),
    ({"abs_tol": 0}, 112.001, False), ({"rel_tol": 0.05}, "1,120", False),
])
def test_numeric_tolerance(tol, value, right):
    assert _numeric(**tol).check(value).correct is right


def test_numeric_feedback_points_at_the_slip():
    n = _numeric()
    assert "factor of 2" in n.check(56).feedback and "Too low" in n.check(56).feedback
    assert "GiB" in n.check(112 / (2**30 / 1e9)).feedback
    assert "bits vs bytes" in n.check(896).feedback
    assert "Expected 112 GB" in n.check(112).feedback  # the value is shown only once answered right
    with pytest.raises(QuizError, match="a number"):
        n.check("lots")


def test_score_counts_latest_answers_first_tries_and_unanswered():
    book = QuizBook("t", seed=0).add(_choice(), _numeric(), _choice("t.d"))
    assert str(book.score()) == "0 of 3 correct (0 at the first try); unanswered: t.c, t.n, t.d"
    book.answer("t.c", "broadcast")
    book.answer("t.c", "reduce-scatter")
    book.answer_all({"t.n": 111})
    s = book.score()
    assert (s.correct, s.total, s.first_try, s.unanswered) == (2, 3, 1, ("t.d",))
    assert "2 of 3 correct" in book.score_text() and "✗" not in book.score_text()


def test_widgets_grade_and_update_the_scoreboard():
    book = QuizBook("t", seed=1).add(_choice(), _numeric())
    box = book.widget()
    with contextlib.redirect_stdout(io.StringIO()) as out:
        book.scoreboard()  # outside IPython: plain text, no waiting
    assert "0 of 2 correct" in out.getvalue()
    radio, button, feedback = box.children[0].children[1:]
    button.click()
    assert "answer first" in feedback.value
    radio.value = "reduce-scatter"
    button.click()
    assert "Right." in feedback.value and book.score().correct == 1
    number, nbutton, nfeedback = box.children[1].children[1:]
    number.value = "abc"
    nbutton.click()
    assert "a number" in nfeedback.value
    book.answer("t.n", 50)  # a headless answer shows in the widget too
    assert "Not quite." in nfeedback.value


def test_show_is_plain_text_outside_jupyter():
    with contextlib.redirect_stdout(io.StringIO()) as out:
        QuizBook("t", seed=0).show(_choice())
    assert "[t.c]" in out.getvalue() and "reduce-scatter" in out.getvalue()


@pytest.mark.parametrize(("build", "message"), [
    (lambda: _choice(correct="gather-all"), "matches none of its 6 options"),
    (lambda: Choice("t.c", "?", {"a": "x", "b": ""}, key=answer_key("t.c", "a")), "feedback"),
    (lambda: Choice("t.c", "?", {"a": "x"}, key=answer_key("t.c", "a")), "at least two"),
    (lambda: Choice("t c", "?", {"a": "x", "b": "y"}, key=answer_key("t c", "a")), "question id"),
    (lambda: Numeric("t.n", "?", key=answer_key("t.other", 3.0), rel_tol=0.1, why="w"), "not a numeric key"),
    (lambda: Numeric("t.n", "?", key=answer_key("t.n", "3"), rel_tol=0.1, why="w"), "not a numeric key"),
    (lambda: Numeric("t.n", "?", key=answer_key("t.n", 3.0), rel_tol=0.1, abs_tol=1, why="w"), "exactly one"),
    (lambda: Numeric("t.n", "?", key=answer_key("t.n", 3.0), rel_tol=0.1), "needs `why`"),
    (lambda: Choice("t.c", "?", {"a": "Right: it sums", "b": "y"}, key=answer_key("t.c", "a")), "verdict"),
    (lambda: Choice("t.c", "?", {"a": "x", "b": "No, it copies"}, key=answer_key("t.c", "a")), r"'No,'"),
    (lambda: Numeric("t.n", "?", key=answer_key("t.n", 3.0), rel_tol=0.1, why="Correct: 3"), "verdict"),
    (lambda: QuizBook("t").add(_choice(), _choice()), r"\['t.c'\] used twice"),
    (lambda: QuizBook("t").add(_choice()).add(_choice(correct="broadcast")), "used twice"),
    (lambda: QuizBook("t").add(_choice()).answer("t.x", "a"), "no question 't.x'"),
    (lambda: QuizBook("t").add(_choice()).answer("t.c", "reduce scatter"), "not one of its options"),
])
def test_bad_definitions_and_answers_raise_clearly(build, message):
    with pytest.raises(QuizError, match=message):
        build()


@pytest.mark.parametrize(("feedback", "found"), [
    ("Right: each backward starts as soon as its gradient can arrive", "Right:"),
    ("No: top-k's message is biased at every step", "No:"), ("Correct. The ring sends 2(N−1) chunks", "Correct."),
    ("Yes because the ring is bandwidth-optimal", "Yes"), ("Not quite: the tree wins for small tensors", "Not quite:"),
    ("Wrong — that is the dp group", "Wrong —"), ("That's right: one chunk per rank", "That's right"),
    ("Exactly. Stage 3 shards all three", "Exactly."), ("Incorrect, since the bubble grows", "Incorrect,"),
    ("No rank ever gathers all keys", None), ("No ZeRO stage shards activations", None),
    ("Correct gradients need every micro-batch", None), ("Exactly one rank holds the sum", None),
    ("That is where lab 02's schedule ends", None), ("True division keeps fp32", None),
])
def test_a_verdict_is_found_only_at_the_start(feedback: str, found: str | None):
    assert verdict(feedback) == found


def test_rerunning_a_cell_readds_the_same_question():
    book = QuizBook("t", seed=0).add(_choice())
    book.answer("t.c", "reduce-scatter")
    assert book.add(_choice()).score().correct == 1


# ---- the notebooks' and labs' quizzes -------------------------------------------------------------------------


def _quiz_cells(path: Path) -> list[nbformat.NotebookNode]:
    return [c for c in nbformat.read(path, as_version=4).cells if "QuizBook(" in c.source]


def _book(path: Path) -> QuizBook:
    [cell] = _quiz_cells(path)
    namespace: dict = {"LEARNER_SEED": 0}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(cell.source, namespace)
    return namespace["QUIZ"]


def _feedback(q: Choice | Numeric) -> list[str]:
    return list(q.options.values()) if isinstance(q, Choice) else [q.why]


@pytest.mark.parametrize("path", NOTEBOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_feedback_explains_without_a_verdict(path: Path):
    """The grade says right or not quite; the feedback says why (Choice and Numeric refuse one at construction)."""
    for qid, q in _book(path).questions.items():
        for text in _feedback(q):
            assert verdict(text) is None, (path.name, qid, text[:60])


def _full_answer(book: QuizBook, qid: str) -> str | float:
    q, answer = book.question(qid), ANSWERS[qid]
    if isinstance(q, Numeric):
        return answer
    [option] = [o for o in q.options if o.startswith(str(answer))]
    return option


@pytest.mark.parametrize("path", NOTEBOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_quiz_grades_its_answer_key_full_marks(path: Path):
    book = _book(path)
    prefix = ("nb" if path.parent.name == "notebooks" else "lab") + path.stem[:2]
    assert set(book.questions) == {q for q in ANSWERS if q.split(".")[0] == prefix}
    for qid in book.questions:
        result = book.answer(qid, _full_answer(book, qid))
        assert isinstance(result, Result) and result.correct, qid
    assert book.score().correct == len(book.questions) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_each_quiz_is_hidden_numeric_and_scored(path: Path):
    nb = nbformat.read(path, as_version=4)
    [cell] = _quiz_cells(path)
    assert cell.metadata["jupyter"]["source_hidden"] and not cell.get("outputs")
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert "LEARNER_SEED" in params.source and "QUIZ_ANSWERS" in params.source
    last_code = [c for c in nb.cells if c.cell_type == "code"][-1]
    assert "QUIZ.scoreboard()" in last_code.source and "QUIZ.answer_all(QUIZ_ANSWERS)" in last_code.source
    assert any(isinstance(q, Numeric) for q in _book(path).questions.values())


@pytest.mark.parametrize("path", NOTEBOOKS + LABS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_answer_key_in_the_notebook_json(path: Path):
    text = path.read_text()
    # A starred option ("* 2. text", the old printed key), not a bold number ("**5.3 s**").
    assert not re.search(r"answers_text|\"answer\"\s*:|answer\s*=\s*\d|\\u2605|(?<!\*)\*[ \t]*\d+\.\s", text)
    book = _book(path)
    [cell] = _quiz_cells(path)
    source = re.sub(r'key="[^"]*"', "", cell.source)
    for qid, q in book.questions.items():
        if isinstance(q, Numeric):
            for shown in {f"{float(ANSWERS[qid]):g}", f"{float(ANSWERS[qid]):.3g}"}:
                unit = "" if len(re.sub(r"\D", "", shown)) > 1 else rf"\s*{re.escape(q.unit)}"  # a bare "1" is no leak
                assert not re.search(rf"(?<![\w.,]){re.escape(shown)}{unit}(?![\w,]|\.\d)", source), (qid, shown)
            power = math.log2(abs(float(ANSWERS[qid]))) if float(ANSWERS[qid]) else 0.5
            if power == int(power) and abs(power) > 2:  # "2^17", "2**17", "2¹⁷": the answer written as a power of 2
                sup = str(int(power)).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
                for shown in (f"2^{int(power)}", f"2**{int(power)}", f"2{sup}"):
                    assert not re.search(rf"(?<![\w.]){re.escape(shown)}(?![\d⁰¹²³⁴⁵⁶⁷⁸⁹])", source), (qid, shown)
    outputs = json.dumps([c.get("outputs", []) for c in nbformat.read(path, as_version=4).cells])
    for q in book.questions.values():
        for feedback in (q.options.values() if isinstance(q, Choice) else [q.why]):
            assert feedback not in outputs


def test_every_question_has_an_answer_and_the_curriculum_is_covered():
    asked = {qid for path in NOTEBOOKS + LABS for qid in _book(path).questions}
    assert asked == set(ANSWERS)
    assert set(CURRICULUM_CHECKS.values()) <= asked


def test_neither_position_nor_length_gives_the_answer_away():
    positions, longest, total = [], 0, 0
    for path in NOTEBOOKS + LABS:
        book = _book(path)
        for qid, q in book.questions.items():
            if isinstance(q, Choice):
                options, answer = list(q.options), _full_answer(book, qid)
                positions.append(options.index(answer))
                longest += len(answer) == max(map(len, options)) and len(options) > 1
                total += 1
    assert max(positions.count(i) for i in set(positions)) <= total / 3  # authoring order varies, too
    assert longest <= total / 4
