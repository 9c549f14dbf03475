"""`data.type: reasoning_gym`: a reasoning-gym dataset (`reasoning_gym.create_dataset(name, seed=,
size=, **settings)`) as `Example`s for the `reasoning_gym` environment, which scores them with the
dataset's own scorer.

The held-out set is the first `num_eval` distinct questions the seeded generator gives (after the
`num_shots` solved examples shown before each question), the training set the next `num_train` distinct ones: split by question, not by seed, because a generator with
easy settings repeats its questions (two seeds would share some, and one seed gives some twice).
Held out first, so that the held-out set does not change with `num_train`. The prompt follows
reasoning-gym's own convention: one of its system prompts asking for the answer in
`<answer></answer>` tags, which is what its `extract_answer` (and so the environment) reads."""

from __future__ import annotations

from typing import Any

from rlmesh.learner.data.examples import Example
from rlmesh.services.config import ReasoningGymDataSection
from rlmesh.services.domain.tasks import reasoning_gym_metadata

# Draws per distinct question wanted before a generator is taken to have run out of new questions.
_DRAWS_PER_QUESTION = 4


def make_dataset(cfg: ReasoningGymDataSection, seed: int, size: int) -> Any:
    """The configured reasoning-gym dataset; ValueError naming the field for an unknown name or bad settings."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as err:
        raise ValueError(f"data.type=reasoning_gym needs reasoning-gym ({err}); pip install 'rlmesh[envs]'") from None
    if cfg.dataset not in DATASETS:
        raise ValueError(f"data.dataset={cfg.dataset!r} is not a reasoning-gym dataset; choices: "
                         f"{', '.join(sorted(DATASETS))}")
    try:
        return reasoning_gym.create_dataset(cfg.dataset, seed=seed, size=size, **cfg.settings)
    except (TypeError, ValueError, AssertionError) as err:  # unknown field, or the config's own validate()
        raise ValueError(f"data.settings={cfg.settings!r} rejected by reasoning-gym's {cfg.dataset!r} config: "
                         f"{type(err).__name__}: {err}") from None


def system_message(name: str | None) -> list[dict[str, str]]:
    if name is None:
        return []
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if name not in SYSTEM_PROMPTS:
        raise ValueError(f"data.system_prompt={name!r} is not one of reasoning-gym's prompts; choices: "
                         f"{', '.join(SYSTEM_PROMPTS)}, or null for none")
    return [{"role": "system", "content": SYSTEM_PROMPTS[name]}]


def load_reasoning_gym(cfg: ReasoningGymDataSection, run_seed: int) -> tuple[list[Example], list[Example]]:
    """(train, eval): distinct questions, none in both; ValueError when the generator cannot give as many."""
    seed = run_seed if cfg.seed is None else cfg.seed
    wanted = cfg.num_shots + cfg.num_eval + cfg.num_train
    max_draws = _DRAWS_PER_QUESTION * wanted
    dataset = make_dataset(cfg, seed, max_draws)
    system = system_message(cfg.system_prompt)
    examples: list[Example] = []
    shots: list[dict[str, str]] = []
    seen: set[str] = set()
    for index in range(max_draws):
        entry = dataset[index]
        if entry["question"] in seen:
            continue
        seen.add(entry["question"])
        try:
            metadata = reasoning_gym_metadata(cfg.dataset, entry)
        except TypeError as err:
            raise ValueError(f"data: reasoning-gym {cfg.dataset!r} entry {index} has metadata that is not JSON "
                             f"({err}); this dataset cannot be sent to the reward server") from None
        user = {"role": "user", "content": cfg.prompt_template.replace("{question}", entry["question"])}
        if len(shots) < 2 * cfg.num_shots:
            shots += [user, {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"}]
            continue
        examples.append(Example(id=f"{cfg.dataset}-{seed}-{index}", messages=[*system, *shots, user],
                                env=cfg.env_name, metadata=metadata))
        if len(examples) == wanted - cfg.num_shots:
            return examples[cfg.num_eval:], examples[: cfg.num_eval]
    raise ValueError(f"data: reasoning-gym {cfg.dataset!r} with settings {cfg.settings!r} gave {len(seen)} "
                     f"distinct questions in {max_draws} draws, fewer than num_shots + num_eval + num_train = {wanted}; "
                     "lower data.num_train / data.num_eval or widen data.settings")
