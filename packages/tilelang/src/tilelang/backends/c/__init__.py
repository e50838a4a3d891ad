"""C + OpenMP backend (target "cpu")."""
