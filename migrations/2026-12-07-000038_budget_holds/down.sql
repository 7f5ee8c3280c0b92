DROP TABLE budget_holds;
