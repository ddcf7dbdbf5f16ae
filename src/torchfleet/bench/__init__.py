"""`torchfleet bench`: the strategy matrix (matrix.py), its cells chosen (cells.py), each one started
(launch_cell.py) and measured (measure_cell.py), and the table, JSON, CSV (report.py) and chart
(chart.py) it produces."""
