"""The CPU backend: a C++ library built on first use (library.py) and its Searcher (searcher.py)."""
