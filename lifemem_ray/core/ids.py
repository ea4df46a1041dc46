"""Ids of stored items and clusters: ``(namespace << ID_SEQ_BITS) | sequence``, sequential
within a store, apart across shards (each shard's store has its own namespace). Numbers in
data (JSON, the API); one way to show one to a person, :func:`id_label`.

>>> id_label(10)
'10'
>>> id_label((2 << ID_SEQ_BITS) | 7)
'2:7'
>>> id_label(None)
'-'
"""

from __future__ import annotations

__all__ = ["ID_SEQ_BITS", "MAX_NAMESPACE", "id_label"]

ID_SEQ_BITS = 40  # the sequence's bits; the namespace takes the bits above
MAX_NAMESPACE = (1 << (63 - ID_SEQ_BITS)) - 1


def id_label(item_id: int | None) -> str:
    """How an id is printed for a person: ``NAMESPACE:SEQUENCE`` (``2:7``), or the sequence
    alone in namespace 0 (a single store's); ``-`` for none (a trajectory not yet in a
    cluster). The data keeps the integer.

    Args:
        item_id: a cluster's or an item's id, or None.

    Returns:
        The label.
    """
    if item_id is None:
        return "-"
    namespace, sequence = item_id >> ID_SEQ_BITS, item_id & ((1 << ID_SEQ_BITS) - 1)
    return f"{namespace}:{sequence}" if namespace else str(sequence)
