"""A node's disk tier: chunks written behind their PUTs into segment files, an index rebuilt from
the segments' journals at start, and reads checked against the chunks' checksums
(``tier.py``; the file formats in ``records.py``, the index in ``index.py``, whose directory it
is in ``identity.py``)."""
