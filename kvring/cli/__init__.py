"""The ``kvring`` command line: ``main`` (the commands), ``drain`` (``kvring drain``)."""
