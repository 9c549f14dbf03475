"""`textarena`: TextArena's single-player games (`textarena` 0.7, `pip install rlmesh[games]`) as
multi-turn episodes, unchanged.

The item's metadata names the game by its TextArena id (`game`, e.g. `GuessTheNumber-v0`,
`TowerOfHanoi-v0`, `Minesweeper-v0-small`) and may give its `seed` (an integer: the same seed, the
same game). The game is made from TextArena's registry in its `-raw` form, without the observation
and action wrappers TextArena adds for chat models that see only the latest text: an rlmesh episode
is the whole conversation, so each turn hands the model only what the game said since its last move
(its rules first, then each answer), and the model's message is the game's action as it is (the
games read their own syntax from it, e.g. `[5]`).

The episode ends when the game does. Reward: the game's own reward for the player (1 for a win, 0
or -1 otherwise, as each game scores it). Components: `correct` (1 for a reward above 0: held-out
accuracy reads it) and `invalid_move` (the game ended the episode on a move it could not take).
Step metadata: `end`, the game's own reason.

A game is TextArena's code: it runs on the reward server's worker threads like every built-in, each
call bounded by `reward.env_timeout_s` (a game that hangs fails its step by name; one that raises
fails the step with its error; a game that never ends stops at `rollout.episode.max_turns`). An
unknown id, a game for more than one player, or a game that cannot start (some need NLTK's word lists
downloaded first) fails the episode's reset, naming the game and why."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from rlmesh.reward_server.environments.base import Message, ResetOutput, StepOutput, ToolSchema

_PLAYER = 0


@dataclass
class GameState:
    game: str
    env: Any
    turns: int = 0
    done: bool = False


def _read_metadata(metadata: dict[str, Any]) -> tuple[str, int | None]:
    game = metadata.get("game")
    if not isinstance(game, str) or not game or len(game) > 200:
        raise ValueError(f"textarena: metadata.game must name a TextArena game id (e.g. 'GuessTheNumber-v0'), "
                         f"got {str(game)[:80]!r}")
    seed = metadata.get("seed")
    if seed is not None:
        if isinstance(seed, float) and seed.is_integer():
            seed = int(seed)  # JSON metadata travels as a protobuf Struct: numbers arrive as floats
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"textarena: metadata.seed must be an integer, got {seed!r:.40}")
    return game, seed


def make_game(game: str) -> Any:
    """A new instance of the game in its raw form; ValueError naming what is missing or unknown."""
    try:
        import textarena
        from textarena.envs.registration import ENV_REGISTRY
    except ImportError as err:
        raise ValueError(f"textarena is not installed on this reward server ({err}); "
                         "pip install 'rlmesh[games]'") from None
    raw = f"{game}-raw"
    if raw not in ENV_REGISTRY:
        single = sorted(k.removesuffix("-raw") for k in ENV_REGISTRY if k.endswith("-raw"))
        raise ValueError(f"textarena: {game!r} is not a TextArena game id; some ids: {', '.join(single[:12])}, ...")
    return textarena.make(raw)


def _said_to_player(observation: list[Any]) -> str:
    """What the game (or another player) said since the player's last move, as one message: the
    raw observation is a list of (from id, text, kind); the player's own moves are left out (the
    conversation already holds them)."""
    parts = [str(text) for sender, text, *_ in observation if sender != _PLAYER]
    return "\n".join(p.strip() for p in parts if p.strip())


class TextArenaEnvironment:
    name = "textarena"
    description = ("TextArena's single-player games by id (metadata.game, metadata.seed), turn by turn; reward = the "
                   "game's reward for the player, components correct (won) and invalid_move")

    def tools(self) -> list[ToolSchema]:
        return []

    def reset(self, metadata: dict[str, Any], prompt: list[Message]) -> ResetOutput:
        game, seed = _read_metadata(metadata)
        env = make_game(game)
        try:
            env.reset(num_players=1, seed=seed)
            _, observation = env.get_observation()
        except Exception as err:  # the game's own code: a two-player game refuses one player, and so on
            raise ValueError(f"textarena: {game} could not start for one player: {type(err).__name__}: "
                             f"{str(err)[:300]}") from None
        return ResetOutput(GameState(game, env), [{"role": "user", "content": _said_to_player(observation)}])

    def step(self, state: GameState, action: Message) -> StepOutput:
        if state.done:
            raise ValueError(f"textarena: the {state.game} episode is over; close the session")
        state.turns += 1
        done, _ = state.env.step(action.get("content", ""))
        if not done:
            _, observation = state.env.get_observation()
            return StepOutput([{"role": "user", "content": _said_to_player(observation)}],
                              metadata={"turns": state.turns})
        state.done = True
        rewards, info = state.env.close()
        reward = rewards.get(_PLAYER) if isinstance(rewards, dict) else None
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise RuntimeError(f"textarena: {state.game} ended with reward {reward!r:.60} for the player, not a finite "
                               "number")
        player = info.get(_PLAYER, {}) if isinstance(info, dict) else {}
        invalid = float(bool(player.get("invalid_move")))
        return StepOutput(reward=float(reward), done=True,
                          components={"correct": float(reward > 0), "invalid_move": invalid},
                          metadata={"turns": state.turns, "end": str(player.get("reason", ""))[:300]})

    def close(self, state: GameState) -> None:
        state.done = True
