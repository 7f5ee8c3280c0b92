DROP TABLE step_failures;
