"""`torchfleet bench`: the strategy matrix (matrix.py), one measured cell (measure_cell.py), and the
table, JSON, CSV (report.py) and chart (chart.py) it produces."""
