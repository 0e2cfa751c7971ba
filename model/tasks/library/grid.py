"""Grid helpers for lists of rows: bounds, neighbours, distances, transposing and flood fill."""

from .mathx import binomial, clamp
from .seqs import chunk, flatten


def in_bounds(grid, row, col):
    """Whether (row, col) is a cell of the rectangular `grid`."""
    return 0 <= row < len(grid) and 0 <= col < len(grid[0])


def neighbours(grid, row, col):
    """The (row, col) cells next to a cell (up, down, left, right) that are inside the grid."""
    out = []
    for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        if in_bounds(grid, row + dr, col + dc):
            out.append((row + dr, col + dc))
    return out


def manhattan(a, b):
    """The Manhattan distance between two (row, col) cells."""
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def transpose(grid):
    """The grid with rows and columns exchanged."""
    return [[grid[r][c] for r in range(len(grid))] for c in range(len(grid[0]))]


def rotate_right(grid):
    """The grid turned a quarter turn clockwise."""
    return [list(reversed(column)) for column in transpose(grid)]


def count_value(grid, value):
    """How many cells of the grid hold `value`."""
    return flatten(grid).count(value)


def region_size(grid, row, col):
    """The number of cells connected to (row, col) through neighbours holding the same value."""
    target = grid[row][col]
    seen = [(row, col)]
    todo = [(row, col)]
    while todo:
        r, c = todo.pop()
        for cell in neighbours(grid, r, c):
            if cell not in seen and grid[cell[0]][cell[1]] == target:
                seen.append(cell)
                todo.append(cell)
    return len(seen)


def step(grid, row, col, move):
    """The cell reached from (row, col) by one move ('U', 'D', 'L' or 'R'), staying inside the grid."""
    dr, dc = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}[move]
    return (clamp(row + dr, 0, len(grid) - 1), clamp(col + dc, 0, len(grid[0]) - 1))


def walk(grid, start, moves):
    """The cells visited from `start` by each move of the string `moves`, start included."""
    path = [start]
    for move in moves:
        path.append(step(grid, path[-1][0], path[-1][1], move))
    return path


def from_cells(cells, width):
    """A grid of rows of `width` cells from its cells listed row after row."""
    return chunk(cells, width)


def lattice_paths(rows, cols):
    """The number of shortest paths from the top-left to the bottom-right cell of a rows x cols grid."""
    return binomial(rows + cols - 2, rows - 1)
