"""The ``zeroshard`` command line: one module per subcommand, ``main`` only dispatches."""
