"""Old module paths, each a file that warns once and hands over to the module's new home (see
``cp_dtensor/_deprecated.py``). The packages add this folder to their ``__path__``; nothing imports it
under its own name."""
