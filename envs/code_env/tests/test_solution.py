import unittest

from solution import add, fizzbuzz


class TestSolution(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
        self.assertEqual(add(-1, 1), 0)

    def test_fizzbuzz(self):
        self.assertEqual([fizzbuzz(i) for i in (1, 3, 5, 15)], ["1", "Fizz", "Buzz", "FizzBuzz"])
