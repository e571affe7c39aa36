select no_such_column from nation;
