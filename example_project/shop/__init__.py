"""The shop app: orders, payments, and the task that cancels unpaid orders."""
