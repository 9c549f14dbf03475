"""Thin servicers: an RPC handler converts protobuf and delegates; it never calls another handler
(an RPC that needs another's work calls the plain function both share). Read from the source with
`ast`, over every servicer class of the three tiers."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("rollout_server", "reward_server", "learner")


def _servicers() -> dict[str, ast.ClassDef]:
    out = {}
    for tier in TIERS:
        for path in (REPO / tier).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        isinstance(b, ast.Attribute) and b.attr.endswith("Servicer") for b in node.bases):
                    out[f"{path.relative_to(REPO)}:{node.name}"] = node
    return out


def handler_calls(cls: ast.ClassDef) -> list[str]:
    """'Caller -> Callee' for each handler (a method named like an RPC) that calls another handler."""
    handlers = {f.name: f for f in cls.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name[:1].isupper()}
    bad = []
    for name, func in handlers.items():
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" \
                    and node.func.attr in handlers:
                bad.append(f"{cls.name}.{name} -> {node.func.attr}")
    return bad


def test_every_tier_has_its_servicer():
    names = {key.split(":")[1] for key in _servicers()}
    assert {"RolloutService", "RewardService", "LearnerService"} <= names


def test_no_handler_calls_another():
    bad = [call for cls in _servicers().values() for call in handler_calls(cls)]
    assert bad == []


def test_a_planted_handler_call_is_caught():
    cls = ast.parse("class S(pb.RolloutServiceServicer):\n"
                    "    async def UpdateWeights(self, request, context):\n"
                    "        await self.PauseGeneration(request, context)\n"
                    "    async def PauseGeneration(self, request, context):\n"
                    "        return None\n").body[0]
    assert handler_calls(cls) == ["S.UpdateWeights -> PauseGeneration"]
