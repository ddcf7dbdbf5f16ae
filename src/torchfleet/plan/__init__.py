"""`torchfleet plan`: predicted memory per rank and step time for each strategy and degree, and a check
of those predictions against bench's measurements where the cells can run."""
