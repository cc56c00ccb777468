"""Roman numerals for the integers 1..3999."""

_VALUES = [
    (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"),
    (100, "C"), (90, "XC"), (50, "L"), (40, "XL"),
    (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
]


def to_roman(number: int) -> str:
    """Return the Roman numeral for ``number`` (1..3999)."""
    if not isinstance(number, int) or isinstance(number, bool):
        raise TypeError("number must be an int")
    if not 1 <= number <= 3999:
        raise ValueError("number must be between 1 and 3999")
    out = []
    for value, symbol in _VALUES:
        while number >= value:
            number -= value
            out.append(symbol)
    return "".join(out)


def from_roman(numeral: str) -> int:
    """Parse a canonical Roman numeral; non-canonical forms such as 'IIII' are rejected."""
    if not isinstance(numeral, str) or not numeral:
        raise ValueError("numeral must be a non-empty string")
    text = numeral.upper()
    total, i = 0, 0
    for value, symbol in _VALUES:
        while text.startswith(symbol, i):
            total += value
            i += len(symbol)
    if i != len(text) or to_roman(total) != text:
        raise ValueError(f"invalid Roman numeral: {numeral!r}")
    return total


def is_roman(numeral: str) -> bool:
    """True if ``numeral`` is a canonical Roman numeral."""
    try:
        from_roman(numeral)
    except ValueError:
        return False
    return True
