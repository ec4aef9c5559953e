from cp_dtensor._deprecated import moved_module

moved_module(__name__, __spec__)
