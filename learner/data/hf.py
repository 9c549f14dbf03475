"""`data.type: hf`: prompts read through Hugging Face `datasets` — local JSONL/JSON, Parquet, Arrow or
CSV files, a directory written by `save_to_disk`, a directory of data files, or a hub dataset name —
and mapped onto rlmesh's examples by the field mapping in `HFDataSection` (prompt text or chat
messages, a system prompt, the environment's metadata columns, DPO's chosen / rejected).

Training rows are issued in epochs, reshuffled every epoch from (run.seed, epoch). In memory that is
a permutation (`TrainOrder`); with `streaming` it is `datasets`' seeded shuffle buffer over a stream
(`StreamOrder`), never holding the split. Either way the order is a function of the cursor alone,
which is what checkpoints save: a resumed learner asks for the same cursor and gets the same row."""

from __future__ import annotations

import glob
import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmesh.learner.data.examples import Example, TrainOrder, assistant_turn
from rlmesh.services.config import HFDataSection

if TYPE_CHECKING:
    import datasets

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_ROW = "__rlmesh_row"  # the row's number in its split, added before a stream is shuffled


def _data_files(location: str) -> list[str] | None:
    """The files a data-file location names (a file or a glob), or None if it names none."""
    if Path(location).suffix not in FORMATS:
        return None
    return sorted(glob.glob(location)) if glob.has_magic(location) else [location]


def open_split(location: str, split: str, cfg: HFDataSection, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """One split of `location`, as a Dataset (or an IterableDataset when `streaming`)."""
    import datasets

    files = _data_files(location)
    if files is not None:
        missing = [f for f in files if not Path(f).is_file()]
        if not files or missing:
            raise ValueError(f"data: {location!r} matches no data file{' (missing: ' + ', '.join(missing) + ')' if missing else ''}; "
                             "give an existing .jsonl/.json/.parquet/.arrow/.csv file or glob")
        # A file holds one split: name it after the split asked for.
        try:
            return datasets.load_dataset(FORMATS[Path(location).suffix], data_files={split: files}, split=split,
                                         streaming=streaming)
        except datasets.exceptions.DatasetGenerationError as err:  # its own message says only that it failed
            cause = err.__cause__ or err.__context__ or err
            raise ValueError(f"data: cannot read {location!r} as {Path(location).suffix} ({type(cause).__name__}: "
                             f"{cause}); fix that file (data.path or data.eval_path names it)") from None
    path = Path(location)
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ValueError(f"data: the saved dataset {location!r} has no split {split!r}; it has "
                                 f"{', '.join(saved)} (data.split / data.eval_split)")
            saved = saved[split]
        return saved.to_iterable_dataset() if streaming else saved
    try:
        return datasets.load_dataset(location, cfg.name, split=split, streaming=streaming)
    except ValueError as err:  # e.g. an unknown split
        raise ValueError(f"data: {location!r} split {split!r}: {err}") from None
    except (OSError, ConnectionError) as err:
        what = "directory" if path.is_dir() else "hub dataset (no such local file or directory)"
        raise ValueError(f"data: cannot read {location!r} as a {what}: {type(err).__name__}: {err}; give a local "
                         "data file, a save_to_disk directory, or a hub name where a hub is reachable") from None


class RowMapping:
    """Turns a row (a dict of columns) into an Example, following the config's field mapping."""

    def __init__(self, cfg: HFDataSection, location: str, split: str) -> None:
        self.cfg, self.where = cfg, f"data: {location!r} split {split!r}"
        self.split = split
        self._skip = {cfg.prompt_key, cfg.messages_key, cfg.chosen_key, cfg.rejected_key, _ROW}

    def __call__(self, row: dict[str, Any], index: int) -> Example:
        cfg = self.cfg
        index = int(row.get(_ROW, index))
        where = f"{self.where} row {index}"
        if row.get(cfg.messages_key) is not None:
            messages = self._messages(row[cfg.messages_key], where)
        elif isinstance(row.get(cfg.prompt_key), list):  # TRL's conversational prompt: a list of messages
            messages = self._messages(row[cfg.prompt_key], where)
        elif row.get(cfg.prompt_key) is not None:
            text = str(row[cfg.prompt_key])
            if cfg.prompt_template is not None:
                text = cfg.prompt_template.replace("{prompt}", text)
            messages = [{"role": "user", "content": text}]
        else:
            columns = ", ".join(k for k in row if k != _ROW)
            raise ValueError(f"{where} has neither {cfg.messages_key!r} (chat messages) nor {cfg.prompt_key!r} "
                             f"(prompt text); its columns: {columns}. Set data.messages_key or data.prompt_key")
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        if cfg.metadata_keys is None:
            metadata = {k: v for k, v in row.items() if k not in self._skip}
        else:
            absent = [k for k in cfg.metadata_keys if k not in row]
            if absent:
                raise ValueError(f"{where}: data.metadata_keys names column(s) {', '.join(absent)} it does not have; "
                                 f"its columns: {', '.join(k for k in row if k != _ROW)}")
            metadata = {k: row[k] for k in cfg.metadata_keys}
        if row.get(cfg.answer_key) is not None:
            metadata["answer"] = row[cfg.answer_key]
        elif cfg.answer_key not in row and cfg.answer_key != type(cfg).model_fields["answer_key"].default:
            # A column named on purpose and missing (a typo): every reward would go without its answer.
            raise ValueError(f"{where}: data.answer_key={cfg.answer_key!r} names a column it does not have; its "
                             f"columns: {', '.join(k for k in row if k != _ROW)}")
        pair = {side: assistant_turn(row[key], f"{where}: {key!r}") if row.get(key) is not None else None
                for side, key in (("chosen", cfg.chosen_key), ("rejected", cfg.rejected_key))}
        row_id = str(row[cfg.id_key]) if cfg.id_key and row.get(cfg.id_key) is not None else f"{self.split}-{index}"
        env = str(row[cfg.env_key]) if cfg.env_key and row.get(cfg.env_key) else cfg.env_name
        return Example(id=row_id, messages=messages, env=env, metadata=metadata, **pair)

    @staticmethod
    def _messages(value: Any, where: str) -> list[dict[str, str]]:
        if not (isinstance(value, list) and value and all(isinstance(m, dict) and m.get("role") and
                                                          isinstance(m.get("content"), str) for m in value)):
            raise ValueError(f"{where}: the messages column must be a non-empty list of {{role, content}} objects")
        # Columnar formats give every message every key seen in the column (None where absent).
        return [{k: str(v) for k, v in m.items() if v is not None and k in ("role", "content", "name", "tool_call_id")}
                for m in value]


class StreamOrder:
    """Training rows read as a stream, epoch after epoch, each epoch shuffled through a buffer
    seeded by (seed, epoch). The epoch's length is learnt when the first epoch ends. `at` reads
    forward; asking for an earlier cursor (a resume) re-opens the stream and skips to it."""

    def __init__(self, stream: datasets.IterableDataset, to_example: RowMapping, seed: int, shuffle: bool,
                 buffer_size: int) -> None:
        self._stream = stream.shuffle(seed=seed, buffer_size=buffer_size) if shuffle else stream
        self._to_example = to_example
        self.length: int | None = None
        self._epoch, self._offset = 0, 0
        self._rows: Iterator[dict[str, Any]] = iter(())
        self._open(0)
        self._next_draw = 0

    def _open(self, epoch: int) -> None:
        self._stream.set_epoch(epoch)
        self._epoch, self._offset, self._rows = epoch, 0, iter(self._stream)

    def _epoch_ended(self) -> None:
        if self._offset == 0:
            raise ValueError(f"{self._to_example.where} has no rows; check data.path, data.split and data.num_train")
        self.length = self._offset

    def at(self, cursor: int) -> Example:
        while True:
            epoch, offset = divmod(cursor, self.length) if self.length else (0, cursor)
            if epoch != self._epoch or offset < self._offset:
                self._open(epoch)
            skipped = sum(1 for _ in itertools.islice(self._rows, offset - self._offset))
            self._offset += skipped
            row = next(self._rows, None) if self._offset == offset else None
            if row is None:  # the first epoch ended before `offset`: now its length is known
                self._epoch_ended()
                continue
            self._offset += 1
            return self._to_example(row, offset)

    def draw(self, rng: random.Random, k: int) -> list[Example]:
        batch = [self.at(self._next_draw + i) for i in range(k)]
        self._next_draw += k
        return batch


def load_hf(cfg: HFDataSection, seed: int) -> tuple[TrainOrder | StreamOrder, list[Example]]:
    """(train, eval): the training split in its per-epoch order, and the held-out rows in memory."""
    eval_location = cfg.eval_path or cfg.path
    if cfg.eval_path is None and (_data_files(cfg.path) is not None or (Path(cfg.path) / "state.json").is_file()):
        raise ValueError(f"data.path={cfg.path!r} is a data file or a saved Dataset, which holds one split: give the "
                         "held-out rows in data.eval_path (a location of their own)")
    to_train = RowMapping(cfg, cfg.path, cfg.split)
    train = open_split(cfg.path, cfg.split, cfg, cfg.streaming)
    if cfg.streaming:
        import datasets

        if not isinstance(train, datasets.IterableDataset):
            train = train.to_iterable_dataset()
        if cfg.num_train is not None:
            train = train.take(cfg.num_train)
        # Number the rows before shuffling, so that an example's id names its row.
        train = train.map(lambda row, i: {**row, _ROW: i}, with_indices=True)
        train_data: TrainOrder | StreamOrder = StreamOrder(train, to_train, seed, cfg.shuffle, cfg.shuffle_buffer)
    else:
        rows = train if cfg.num_train is None else train.select(range(min(cfg.num_train, len(train))))
        train_data = TrainOrder([to_train(row, i) for i, row in enumerate(rows)], seed, cfg.shuffle)
    to_eval = RowMapping(cfg, eval_location, cfg.eval_split)
    # Streamed only to take its first rows: reading a whole stream ends in `datasets`' 5 s pause at
    # the end of a shard, and every held-out row is kept in memory anyway.
    held_out = open_split(eval_location, cfg.eval_split, cfg, cfg.streaming and cfg.num_eval is not None)
    rows = itertools.islice(held_out, cfg.num_eval) if cfg.num_eval is not None else held_out
    return train_data, [to_eval(row, i) for i, row in enumerate(rows)]
