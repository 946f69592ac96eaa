"""Rebuild agent_loop.jsonl from a local copy of the Berkeley Function-Calling Leaderboard (BFCL).

    python -m edgespec.bench.sessions.make_agent_loop GORILLA/berkeley-function-call-leaderboard > agent_loop.jsonl

Not used at run time (the suite is vendored); kept so the provenance of every message can be checked.
GORILLA is a checkout of ShishirPatil/gorilla (README.md here names the commit). Per BFCL multi-turn
entry in ENTRIES, the first STEPS ground-truth calls become the session's turns; taken from the
dataset: the user requests, the tool schemas (name, description, parameters; "response" dropped)
and the calls; derived: each tool result, by running the call on BFCL's own reference
implementation of the tool (bfcl_eval/eval_checker/multi_turn_eval/func_source_code, imported from
the checkout, loaded with the entry's initial_config, as BFCL's evaluator does). Written here: the
system prompt and the JSON layout of calls and results.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import sys
from pathlib import Path

ENTRIES = (10, 33, 77, 82, 107, 114)  # multi_turn_base_N: files, files + messages, vehicle + posts, vehicle, ...
STEPS = 5  # ground-truth calls per session (= turns)
MAX_TOKENS = 128  # a turn's reply is one tool call
DATA = "bfcl_eval/data"
SYSTEM = ("You are an agent that completes the user's requests by calling tools. The tools, as JSON schemas:\n"
          "{tools}\n"
          'Reply to every message with exactly one tool call, as a JSON object {{"name": TOOL, "arguments": '
          '{{...}}}}, and nothing else. A tool\'s result comes back as a user message {{"tool": TOOL, '
          '"result": ...}}, sometimes followed by the user\'s next request.')


def _jsonl(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {r["id"]: r for r in rows}


def _docs(root: Path) -> dict[str, dict]:
    docs = {}
    for f in sorted((root / DATA / "multi_turn_func_doc").glob("*.json")):
        for line in f.read_text(encoding="utf-8").splitlines():
            d = json.loads(line)
            docs[d["name"]] = {k: d[k] for k in ("name", "description", "parameters")}
    return docs


def _instances(entry: dict) -> dict[str, object]:
    """Method name -> bound method of BFCL's tool classes, loaded with the entry's initial state."""
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES

    methods = {}
    for name in entry["involved_classes"]:
        obj = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[name]), name)()
        if name not in STATELESS_CLASSES:
            obj._load_scenario(copy.deepcopy(entry["initial_config"].get(name, {})), long_context=False)
        methods.update({m: f for m, f in inspect.getmembers(obj, inspect.ismethod) if not m.startswith("_")})
    return methods


def _call(text: str, methods: dict) -> tuple[str, dict]:
    """A ground-truth call string, e.g. "mv(source='a', destination='b')", as (name, keyword arguments)."""
    node = ast.parse(text, mode="eval").body
    name = node.func.id
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return name, dict(inspect.signature(methods[name]).bind(*args, **kwargs).arguments)


def _result(value: object) -> object:
    return json.loads(json.dumps(value, default=str))


def session(n: int, entry: dict, truth: list[list[str]], docs: dict) -> dict:
    methods = _instances(entry)
    steps = [(i, c) for i, calls in enumerate(truth) for c in calls][:STEPS]
    names = list(dict.fromkeys(_call(c, methods)[0] for _, c in steps))
    system = SYSTEM.format(tools="\n".join(json.dumps(docs[f], ensure_ascii=False) for f in names))
    messages, turns, asked = [{"role": "system", "content": system}], [], -1
    for i, text in steps:
        if i != asked:  # the user's next request (after the last tool result, if any)
            request = entry["question"][i][0]["content"].strip()
            if messages[-1]["role"] == "user":
                messages[-1]["content"] += "\n\n" + request
            else:
                messages.append({"role": "user", "content": request})
            asked = i
        name, kwargs = _call(text, methods)
        call = json.dumps({"name": name, "arguments": kwargs}, ensure_ascii=False)
        turns.append({"messages": copy.deepcopy(messages), "max_tokens": MAX_TOKENS, "expected": call})
        result = _result(methods[name](**kwargs))
        messages += [{"role": "assistant", "content": call},
                     {"role": "user", "content": json.dumps({"tool": name, "result": result}, ensure_ascii=False)}]
    return {"id": f"agent-{n:02d}", "category": "agent_loop",
            "source": f"BFCL {entry['id']} (ShishirPatil/gorilla, Apache-2.0)", "turns": turns}


def main(argv: list[str]) -> None:
    root = Path(argv[0]).resolve()
    sys.path.insert(0, str(root))  # BFCL's package: its tools, run for the results
    questions = _jsonl(root / DATA / "BFCL_v4_multi_turn_base.json")
    answers = _jsonl(root / DATA / "possible_answer" / "BFCL_v4_multi_turn_base.json")
    docs = _docs(root)
    for n, e in enumerate(ENTRIES, 1):
        key = f"multi_turn_base_{e}"
        print(json.dumps(session(n, questions[key], answers[key]["ground_truth"], docs), ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])
