"""The plan, torch-free but for ``spec``: which global positions a rank holds (``layout``), which rectangles of
each ring step run (``masks``), the bytes on the wire (``wire``), a document layout's placement (``doc_plan``,
``documents``) and a ring call's frozen options (``spec``). Importing this package imports nothing.
"""
