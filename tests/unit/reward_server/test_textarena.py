"""The `textarena` environment plays TextArena's own games unchanged: the game's rules open the
episode, each step hands the model only what the game said since its move, the game's reward ends
it; a bad id, a two-player game, a bad seed or a step after the end is refused by name. And the
`data.type: textarena` source splits game seeds without overlap."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("textarena")

from rlmesh.learner.data.sources import load_dataset  # noqa: E402
from rlmesh.reward_server.environments.textarena import TextArenaEnvironment  # noqa: E402
from rlmesh.services.config import TextArenaDataSection  # noqa: E402

GAME = "GuessTheNumber-v0"


def _play_by_halving(env: TextArenaEnvironment, seed: int) -> tuple[list[str], object]:
    """A player that reads the game's answers: bisects [1, 20] until the game ends."""
    reset = env.reset({"game": GAME, "seed": float(seed)}, [])  # a Struct's numbers arrive as floats
    said = [reset.observation[0]["content"]]
    low, high = 1, 20
    while True:
        guess = (low + high) // 2
        out = env.step(reset.state, {"role": "assistant", "content": f"My guess: [{guess}]"})
        if out.done:
            return said, out
        said.append(out.observation[0]["content"])
        if "higher" in said[-1]:
            low = guess + 1
        else:
            high = guess - 1


def test_a_player_that_reads_the_answers_wins_with_the_game_s_reward():
    env = TextArenaEnvironment()
    said, end = _play_by_halving(env, seed=3)
    assert "Guess The Number" in said[0] and "between 1 and 20" in said[0]
    # Each answer is the game's new message only: the rules and the player's own moves are not repeated.
    assert all(re.fullmatch(r"The target number is (higher|lower)\.", s) for s in said[1:]), said
    assert end.reward == 1.0 and end.components == {"correct": 1.0, "invalid_move": 0.0}
    assert "guessed the correct number" in end.metadata["end"] and end.metadata["turns"] == len(said)
    # The same seed, the same game.
    assert _play_by_halving(TextArenaEnvironment(), seed=3)[0] == said


def test_a_move_the_game_cannot_read_ends_the_episode_as_the_game_scores_it():
    env = TextArenaEnvironment()
    reset = env.reset({"game": GAME, "seed": 1}, [{"role": "user", "content": "Play."}])
    first = env.step(reset.state, {"role": "assistant", "content": "no number here"})
    assert not first.done and "invalid move" in first.observation[0]["content"]
    end = env.step(reset.state, {"role": "assistant", "content": "still none"})
    assert end.done and end.reward == 0.0 and end.components == {"correct": 0.0, "invalid_move": 1.0}
    with pytest.raises(ValueError, match="episode is over"):
        env.step(reset.state, {"role": "assistant", "content": "[3]"})


@pytest.mark.parametrize(("metadata", "says"), [
    ({"game": "NoSuchGame-v0"}, "'NoSuchGame-v0' is not a TextArena game id"),
    ({"game": "TicTacToe-v0"}, "TicTacToe-v0 could not start for one player"),
    ({}, "metadata.game must name a TextArena game id"),
    ({"game": GAME, "seed": "seven"}, "metadata.seed must be an integer"),
    ({"game": GAME, "seed": 1.5}, "metadata.seed must be an integer"),
])
def test_what_cannot_be_played_is_refused_by_name(metadata, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        TextArenaEnvironment().reset(metadata, [])


def test_the_data_source_splits_game_seeds_without_overlap():
    cfg = TextArenaDataSection(game=GAME, num_train=30, num_eval=10, system_prompt="Answer with [n].")
    train, evals = load_dataset(cfg, seed=2)
    train = list(train.examples)
    seeds = lambda examples: {e.metadata["seed"] for e in examples}  # noqa: E731
    assert len(seeds(train)) == 30 and len(seeds(evals)) == 10 and not seeds(train) & seeds(evals)
    assert {e.env for e in train + evals} == {"textarena"}
    assert all(e.metadata["game"] == GAME and e.messages == [{"role": "system", "content": "Answer with [n]."}]
               for e in train + evals)
    # The held-out seeds do not move with num_train.
    _, same = load_dataset(TextArenaDataSection(game=GAME, num_train=5, num_eval=10), seed=2)
    assert seeds(same) == seeds(evals)
