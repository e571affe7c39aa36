select * from no_such_table;
