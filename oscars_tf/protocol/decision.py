"""One round's membership as the chief decided it (membership.py)."""

import dataclasses
import json
from typing import Any
from typing import Optional
from typing import Tuple

import numpy as np

from oscars_tf.protocol import decision_codec


@dataclasses.dataclass(frozen=True)
class Decision:
  """One round's membership, as the chief decided it."""
  round: int
  members: Tuple[int, ...]     # workers in this round's collectives
  newcomers: Tuple[int, ...]   # members rejoining: they take the model
  dropped: Tuple[int, ...]     # members of the previous round left out
  rows: Tuple[Optional[Tuple[float, ...]], ...]  # None for non-members
  epoch_done: int = 0          # cluster steps of the epoch, as the chief
                               # counted them (a newcomer adopts it)
  chief_plan: Optional[dict] = None  # what newcomers adopt to plan like
                                     # the others (only when they join)
  # The rows as one n x width array (NaN for non-members) when decoded
  # from the store: the round book takes it whole instead of row by row.
  row_array: Any = dataclasses.field(default=None, compare=False,
                                     repr=False)

  def table_rows(self, n, width):
    """The rows as an n x `width` array (NaN where none)."""
    rows = np.full([n, width], np.nan)
    if self.row_array is not None:  # decoded whole from the store
      known = min(width, self.row_array.shape[1])
      rows[:, :known] = self.row_array[:, :known]
    else:
      for j, r in enumerate(self.rows):
        if r is not None:
          rows[j, :len(r)] = r[:width]
    return rows

  def encode(self):
    """Compact store text (decision_codec.py)."""
    return decision_codec.encode_decision(self)

  @classmethod
  def decode(cls, text):
    return decision_codec.decode_decision(text, cls)

  def to_json(self):
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
         if f.name != "row_array"}
    d["rows"] = tuple(d["rows"])  # a decoded decision's are a RowView
    return json.dumps(d, allow_nan=True)

  @classmethod
  def from_json(cls, text):
    d = json.loads(text)
    return cls(round=d["round"], members=tuple(d["members"]),
               newcomers=tuple(d["newcomers"]), dropped=tuple(d["dropped"]),
               rows=tuple(None if r is None else tuple(r) for r in d["rows"]),
               epoch_done=d.get("epoch_done", 0),
               chief_plan=d.get("chief_plan"))
